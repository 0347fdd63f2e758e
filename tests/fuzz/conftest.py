import os
import sys

# The fuzzer's helpers (fuzz_oracle, fuzz_cases) are imported as plain modules.
sys.path.insert(0, os.path.dirname(__file__))
