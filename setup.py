"""k25jax: an open JAX training stack for Kimi K2.5.

Install: pip install -e ".[dev]"
"""
from setuptools import find_packages, setup

setup(
    name="k25jax",
    version="0.1.0",
    description="JAX/Flax training stack for Kimi K2.5 (K2 MoE backbone, MoonViT-3D, RL, Toggle, PARL).",
    packages=find_packages(include=["k25jax", "k25jax.*", "pallas_kernels", "pallas_kernels.*"]),
    package_data={"k25jax.data": ["chat_template.jinja"]},   # written into exported checkpoints
    python_requires=">=3.11",
    install_requires=[
        "jax>=0.10.2",
        "flax>=0.12",
        "optax>=0.2.7",
        "orbax-checkpoint",
        "grain",
        "ml-collections",
        "tensorboard",     # event files (k25jax/train/loop.py); tensorboardX imported torch where installed
        "safetensors",
        "ml_dtypes",       # bfloat16 / float8 arrays in k25jax/convert/safetensors_io.py
        "tiktoken",        # Kimi's tiktoken.model (k25jax/data/tokenizer_files.py)
        "tokenizers",      # HF tokenizer.json files (DeepSeek-V3 family)
        "regex",           # Kimi's pre-tokenizer pattern outside tiktoken (experiments/bench_tokenizer.py)
        "absl-py",
        "numpy",
        "reasoning-gym",   # offline verifiable tasks (k25jax/rl/tasks.py)
        "pyarrow",         # Parquet files as a data source (k25jax/data/files.py)
        "math-verify",     # the `math` verifier of RL prompt files (k25jax/rl/verifiers.py)
    ],
    # jax calls k25jax.tpu_probe.initialize() before creating backends: libtpu stays quiet
    # on hosts without TPU chips (the dev extra installs it for the TPU compile test).
    entry_points={"jax_plugins": ["k25jax_tpu_probe = k25jax.tpu_probe"]},
    extras_require={
        "dev": [
            "pytest",
            "pytest-xdist",    # the suite's workers (pytest.ini: -n auto, whole files to a worker)
            "torch==2.13.0",
            "transformers>=5.13",
            "compressed-tensors",
            "matplotlib",
            "nbformat",        # colab/*.ipynb executed top to bottom by tests/test_notebooks.py
            "nbclient",
            "ipykernel",       # the python3 kernel nbclient starts
            "jax[tpu]>=0.10.2",  # libtpu for tests/test_aot_compile.py (compile only; the CPU stays the backend)
        ],
        # libtpu at jax's version: TPU runs, and compiling a pod's train step from a CPU
        # (experiments/aot_compile.py).
        "tpu": ["jax[tpu]>=0.10.2"],
        # TRL's GRPOTrainer, the peer of experiments/bench_rl.py (with the dev extra's torch).
        "bench": ["trl==1.16.0"],
    },
)
