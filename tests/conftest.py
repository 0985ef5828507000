"""Test set-up: 8 host devices so every sharding path is exercised on CPU, compiled with
cpu_env.COMPILE_FLAGS; pytest-xdist workers (pytest.ini) share one compilation cache."""
import os
import sys

# The checkout first on sys.path: config files, and tests, import `configs.common`.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from cpu_env import xla_flags  # noqa: E402

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + xla_flags(8)).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import atexit  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402

# A persistent compilation cache for this test session only: tests that build their own
# jitted steps over the same configs (and the subprocesses they start) compile each
# program once. The process that starts the session makes it; its xdist workers and their
# subprocesses inherit it through the environment.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  _COMPILE_CACHE = tempfile.mkdtemp(prefix="k25jax_test_jax_cache_")
  atexit.register(shutil.rmtree, _COMPILE_CACHE, ignore_errors=True)
  os.environ["JAX_COMPILATION_CACHE_DIR"] = _COMPILE_CACHE
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
# Runs several test files start from (tests/shared_runs.py), made once for the session in the same way.
if "K25JAX_TEST_SHARED_DIR" not in os.environ:
  _SHARED = tempfile.mkdtemp(prefix="k25jax_test_shared_runs_")
  atexit.register(shutil.rmtree, _SHARED, ignore_errors=True)
  os.environ["K25JAX_TEST_SHARED_DIR"] = _SHARED
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import jax  # noqa: E402  (must follow the XLA_FLAGS above)
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


MAX_WORKERS = 4

# Tests marked slow here, not in their files: the costliest items of modules that keep fast tests of
# their own in the inner loop (a parametrised case beside its siblings, a parity check beside the
# module's others), 6-16 CPU-s each on this 2-core machine (tiled_256_keys_narrower ~12 s: 16
# interpreted key blocks a query block, the first listed). The inner loop took 802 CPU-s (424 s) with
# the other 29 in it, 589 (310 s) without; six more of 7-10 s took 598 (315 s), their compiles moving
# to the cases beside them, so they stayed. The full suite, as CI runs it, runs every one.
SLOW_IN_THE_INNER_LOOP = frozenset(f"tests/{item}" for item in (
    "test_agents_sandbox.py::test_sixty_four_concurrent_sessions_give_correct_results",
    "test_attention.py::test_packed_documents_equal_separate_runs",
    "test_data_files.py::test_runs_read_prepared_shards_in_their_token_share_and_refuse_another_tokenizer",
    "test_expert_parallel.py::test_dispatch_equals_dense_values_and_gradients[all_to_all-random]",
    "test_expert_parallel.py::test_layer_equals_single_device[data2-expert4-learned]",
    "test_grm.py::test_every_response_and_sample_goes_through_one_decode_on_the_mesh_with_its_image",
    "test_hf_fp8.py::test_fp8_weights_load_dequantized_and_match_transformers",
    "test_hf_parity.py::test_logits_match_transformers[grouped_dense2-dense]",
    "test_hf_parity.py::test_long_sequence_takes_the_chunked_attention_path",
    "test_int4.py::test_quantized_checkpoint_loads_dequantized",
    "test_kernels_attention.py::test_flash_attention_equals_xla[bf16]",
    "test_kernels_attention.py::test_flash_attention_equals_xla[ragged_seq_segments]",
    "test_kernels_attention.py::test_flash_attention_equals_xla[tiled_200_blocks_64]",
    "test_kernels_attention.py::test_flash_attention_equals_xla[tiled_256_keys_narrower]",
    "test_kernels_model.py::test_pallas_decode_equals_xla",
    "test_kernels_moe.py::test_gmm_equals_xla_values_and_gradients[all_empty]",
    "test_kernels_moe.py::test_route_equals_xla[gpu_k3_unnormalised]",
    "test_kernels_moe.py::test_route_equals_xla[group_limited]",
    "test_kernels_moe.py::test_routed_experts_equal_dense_values_and_gradients",
    "test_kernels_vision_attention.py::test_flash_attention_equals_xla[bf16]",
    "test_kernels_vision_attention.py::test_flash_attention_equals_xla[interleaved_ids]",
    "test_model_config.py::test_eval_shape_matches_analytic_count[k25]",
    "test_moe.py::test_paths_equal_dense_values_and_gradients[ragged_auto-random]",
    "test_recipe.py::test_init_from_names_the_field_the_pair_needs",
    "test_rl_sampler.py::test_stop_tokens_end_rows_and_pad",
    "test_rl_sampler.py::test_top_k_one_is_greedy_and_sampling_is_seeded",
    "test_scan.py::test_scanned_equals_per_layer_logits_and_aux",
    "test_vision_model.py::test_k25_preset_parameter_counts",
    "test_vision_model.py::test_packed_items_do_not_see_each_other",
    "test_vision_model.py::test_text_loss_trains_the_vision_tower"))


def pytest_configure(config):
  config.addinivalue_line("markers", "slow: stage runs, multi-device comparisons, pod compiles: over ~10 s each on 2 "
                          "cores (and SLOW_IN_THE_INNER_LOOP); CI runs them, the inner loop (-m \"not slow\") does not")


@pytest.hookimpl(tryfirst=True)     # before `-m` deselects
def pytest_collection_modifyitems(config, items):
  """Marks SLOW_IN_THE_INNER_LOOP's items slow; when the whole suite is collected (no paths given),
  a name there that it does not have is an error."""
  collected = {item.nodeid for item in items}
  missing = sorted(SLOW_IN_THE_INNER_LOOP - collected)
  if config.args_source != pytest.Config.ArgsSource.ARGS and missing:
    raise pytest.UsageError(f"tests/conftest.py: SLOW_IN_THE_INNER_LOOP names tests the suite does not have: {missing}")
  for item in items:
    if item.nodeid in SLOW_IN_THE_INNER_LOOP:
      item.add_marker(pytest.mark.slow)


def pytest_xdist_auto_num_workers(config):
  """`-n auto`: a worker a core, at most MAX_WORKERS (each holds 8 host devices' programs)."""
  return max(1, min(os.cpu_count() or 1, MAX_WORKERS))
