"""The names of env.json's "hardware" facts that change a run's bits, beside the code that
writes them (engine.hardware) and torch-free, so that launch compares runs by the same names
without importing torch (launch.hardware). Renaming a fact here renames it for both."""

# The facts that change bits, in the order a note names them: the same config, seed and code
# give the same bits only on the same CPU model and instruction set, with as many CPU threads
# (a reduction split otherwise sums in another order), BLAS, GPU, driver, CUDA, cuDNN, NCCL and
# torch.
BITS = (
    "cpu_model",
    "cpu_capability",
    "cpu_threads",
    "blas",
    "gpu_models",
    "driver",
    "cuda",
    "cudnn",
    "nccl",
    "torch",
)
# What `make reproduce` calls the same machine: a CPU recipe's bits depend on these.
SAME_MACHINE = ("cpu_model", "cpu_capability", "cpu_threads", "torch")
