# python -m k25jax.main --config=configs/parl.py --workdir=runs/parl
"""PARL: an orchestrator learns by RL to split wide-search tasks over frozen sub-agents.

`get_config("tiny")` (default): the synthetic wide-search environment (32 entities × 4
attributes, wide tasks of 2–8 entities and deep chains, a 4-critical-step budget) and a
~250k-param K2 decoder on CPU: a built-in SFT warm start on scripted demonstrations of
both roles, then RL of the orchestrator with the K2.5 loss; ends with a summary table
(trained swarm vs the single agent on held-out tasks). About 10–15 minutes on 2 cores.
"""
import ml_collections

from k25jax.agents import dsl
from k25jax.train.config_utils import adamw_section, model_section

PRESETS = ("tiny",)

TINY_MODEL = dict(vocab_size=dsl.VOCAB_SIZE, hidden_size=96, intermediate_size=256, moe_intermediate_size=96,
                  num_hidden_layers=3, num_attention_heads=4, n_routed_experts=4, num_experts_per_tok=2,
                  q_lora_rank=48, kv_lora_rank=48, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=24,
                  max_position_embeddings=128)


def get_config(arg=None):
  preset = arg or "tiny"
  if preset not in PRESETS:
    raise ValueError(f"configs/parl.py: unknown preset {preset!r}; choose from {PRESETS}")
  c = ml_collections.ConfigDict()
  c.stage = "parl"
  c.model = model_section("tiny", **TINY_MODEL)

  # One SFT model on demonstrations of both roles when `checkpoint` is empty; it is both
  # the orchestrator's start and the frozen sub-agents (unless parl.subagent_checkpoint).
  c.warm_start = ml_collections.ConfigDict(dict(
      checkpoint="", demonstrations=6000, steps=400, batch=128, seed=0, pack=True, log_every=50,
      checkpoint_every=200, router_bias_rate=1e-3, optimizer=adamw_section(3e-3, 40, 150)))

  c.parl = ml_collections.ConfigDict(dict(
      budget=4,                    # CriticalSteps budget per episode (truncates, never zeroes)
      deep_fraction=0.25,          # share of deep (sequential) tasks, where spawning cannot help
      lambda1=0.1, lambda2=0.1,    # weights of r_parallel and r_finish, annealed to 0 (at 0.3/0.2 over
      anneal_steps=60, anneal_kind="linear",   # 80 iterations the swarm also spawned on deep tasks)
      parallel_cap=4,              # r_parallel = min(#sub-agents, cap) / cap
      subagent_checkpoint="",      # frozen sub-agents' checkpoint ('' = the warm start)
      orchestrator_turn_tokens=40, subagent_turn_tokens=20,
      eval_tasks=96, eval_seed=12345))

  c.rl = ml_collections.ConfigDict(dict(
      iterations=120, prompts_per_iteration=16, num_generations=8, minibatches=2, temperature=1.0,
      eval_every=20, log_every=10, checkpoint_every=40, seed=0))

  c.loss = ml_collections.ConfigDict(dict(name="k25", alpha=-0.5, beta=0.5, tau=0.01, normalize="batch",
                                          eps=0.2, eps_high=0.28))
  c.optimizer = adamw_section(3e-4, 5, 0)
  c.mesh = ml_collections.ConfigDict(dict(data=-1, fsdp=1, expert=1, sequence=1, tensor=1))
  c.train = ml_collections.ConfigDict(dict(router_bias_rate=1e-3))
  return c
