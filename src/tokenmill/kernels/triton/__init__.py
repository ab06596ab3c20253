"""Triton kernels for the GPU path: paged attention (`paged_attention.py`) and the fused elementwise layers
(`elementwise.py`). Each is tested on the CPU under Triton's interpreter (TRITON_INTERPRET=1) against
its torch reference, and on a GPU where one is present. Importing this package imports triton; callers
import it only where the Triton path is chosen."""
