import os
import sys

import torch

# Tests import their helpers as a plain module.
sys.path.insert(0, os.path.dirname(__file__))
torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
