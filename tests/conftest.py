"""Run Triton kernels in the CPU interpreter when there is no GPU; Triton reads this when a kernel is decorated."""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
