"""Numbers more than one module needs, defined once."""

MIB = 1 << 20
GIB = 1 << 30
CHUNK = 256  # prompt chunk: chunks start at multiples of it from position 0 (lanes.py, the planner)
