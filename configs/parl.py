# python -m k25jax.main --config=configs/parl.py --workdir=runs/parl
"""PARL: an orchestrator learns by RL to split wide-search tasks over frozen sub-agents.

`get_config("tiny")` (default): the synthetic wide-search environment (32 entities × 4
attributes, wide tasks of 2–24 entities and deep chains of 4–10 hops, a critical-step
budget of 3–10 drawn per task and shown in the prompt) and a ~250k-param K2 decoder on
CPU: a built-in SFT warm start on scripted demonstrations (the orchestrator's solve tasks
alone, so it starts in serial collapse; the sub-agents' are complete), then RL of the
orchestrator with the K2.5 loss; ends with a summary table by task width (trained swarm,
warm start, single agent on held-out tasks). Agents name lookups by reference (`assign A
S1 .. Sk all`, `search A next`, `answer all`: `k25jax/agents/tools.py`), so a model this
small orchestrates without copying entity lists. About 6 minutes on 2 cores.

Renderings (`parl.rendering`, `k25jax/agents/widesearch/rendering.py`): the same tasks,
tools and scores, read and written either in the 91-id DSL (the default: one id a word,
the fast CPU preset) or, with the `chat` switch (`configs/parl.py:tiny,chat`), in k25jax's
own chat format (data/legacy_chat.py) through its chat tokenizer (bytes + media + role
tokens, 268 ids) on the tiny chat model's decoder (`common.TINY_CHAT_TEXT`, the recipe's model): contexts are
about 3.7x longer in ids. `warm_start.after_init=True` fine-tunes `init.checkpoint` on the
demonstrations before RL (the recipe's PARL stage: a model that has never seen the
protocol); it is then both the orchestrator's start and the sub-agents. The chat
rendering has no single-agent baseline row (its `create` is bytes, not one id to ban).
With `k25_format` (`configs/parl.py:tiny,k25_format`, `widesearch/k25_rendering.py`) the
same model reads and writes Kimi K2.5's chat format (the tools declared in a
`tool_declare` turn, each call group a tool call with JSON arguments, results as tool
turns; the K2.5 byte vocabulary, 275 ids): over bytes its contexts are ~5x the legacy
chat's (mean 891 ids against 178 over the demonstrations, at most ~2,440; turns of up to
223 ids), so 2,560 positions.

Run length: `train.steps` RL iterations (`rl.prompts_per_iteration` tasks ×
`rl.num_generations` episodes, then `rl.minibatches` updates). The orchestrator's RL
updates use MuonClip (`--config.optimizer.name=adamw` switches); the warm start's SFT fits
its demonstrations with AdamW, as configs/rl.py's does.
"""
import ml_collections

from configs import common

DSL_VOCAB_SIZE = 91   # the wide-search DSL's tokens (`k25jax.agents.dsl.VOCAB_SIZE`)
TINY_MODEL = dict(vocab_size=DSL_VOCAB_SIZE, hidden_size=96, intermediate_size=256, moe_intermediate_size=96,
                  num_hidden_layers=3, num_attention_heads=4, n_routed_experts=4, num_experts_per_tok=2,
                  q_lora_rank=48, kv_lora_rank=48, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=24,
                  max_position_embeddings=192)
# The chat rendering's contexts (`ChatRendering.max_context`): a budget-16 demonstration is
# at most ~520 ids, a turn 88.
CHAT_MODEL = dict(common.TINY_CHAT_TEXT, max_position_embeddings=640)
# Kimi K2.5's format (`K25Rendering.max_context`): a budget-16 demonstration is at most ~2,440 ids.
K25_FORMAT_MODEL = dict(common.TINY_CHAT_TEXT, vocab_size=common.K25_FORMAT_VOCAB_SIZE, max_position_embeddings=2560)


def get_config(arg=None):
  _, switches = common.preset_and_switches(arg, "configs/parl.py", ("tiny",), ("chat", "k25_format"))
  k25_format = "k25_format" in switches
  chat = "chat" in switches and not k25_format
  c = ml_collections.ConfigDict()
  c.stage = "parl"
  c.model = common.model_section("tiny", **(K25_FORMAT_MODEL if k25_format else CHAT_MODEL if chat else TINY_MODEL))
  c.init = common.init_section()       # init.checkpoint: the orchestrator's start; '' = the warm start below

  # One SFT model on demonstrations of both roles when init.checkpoint is empty; it is both
  # the orchestrator's start and the frozen sub-agents (unless parl.subagent_checkpoint).
  # Its orchestrator demonstrations solve tasks alone; `delegation_share` of them open by
  # splitting the task over a random number of sub-agents (shown, not preferred). Each
  # episode adds `subagent_rows` sub-agent demonstrations, and `capability_share` of them
  # a split episode with no loss on the choice to split (`widesearch.demonstrations`). They
  # span budgets 3-16, so the single agent can be measured beyond RL's budgets
  # (experiments/swarm_latency.py).
  c.warm_start = ml_collections.ConfigDict(dict(
      demonstrations=6000, steps=300, batch=32, seed=0, pack=True, log_every=50,
      checkpoint_every=150, router_bias_rate=1e-3, max_consecutive_skipped=10,
      delegation_share=0.07, subagent_rows=2, capability_share=0.5, budget_range=(3, 16), after_init=False,
      optimizer=common.optimizer_section(3e-3, 40, 100)))

  c.parl = ml_collections.ConfigDict(dict(
      budget_range=(3, 10),        # CriticalSteps budget, drawn per task and shown to the orchestrator
      n_range=(2, 24),             # entities of a wide task
      hops_range=(4, 10),          # rows of a deep chain
      deep_fraction=0.25,          # share of deep (sequential) tasks, where spawning cannot help
      lambda1=0.1, lambda2=0.1,    # weights of r_parallel and r_finish, annealed to 0
      anneal_steps=40, anneal_kind="linear",
      parallel_cap=2,              # r_parallel = min(#sub-agents, cap) / cap: near-binary
      subagent_checkpoint="",      # frozen sub-agents' checkpoint ('' = the orchestrator's start)
      subagent_failure=0.0,        # probability a sub-agent's hand-back is lost (widesearch.Episode)
      subagent_step_cost=1,        # critical steps a sub-agent step takes
      # what the model reads and writes: the DSL's ids, k25jax's own chat format or Kimi K2.5's
      rendering="k2.5" if k25_format else "chat" if chat else "dsl",
      orchestrator_turn_tokens=224 if k25_format else 88 if chat else 24,
      subagent_turn_tokens=64 if k25_format else 20 if chat else 8,
      eval_tasks=128, eval_seed=12345))

  c.rl = ml_collections.ConfigDict(dict(prompts_per_iteration=16, num_generations=8, minibatches=2, temperature=1.0))

  c.loss = common.policy_loss_section()
  c.optimizer = common.optimizer_section(3e-4, 5, 0, name="muonclip")
  c.mesh = common.mesh_section()
  c.train = ml_collections.ConfigDict(dict(
      steps=80, log_every=10, eval_every=20, checkpoint_every=40, checkpoint_minutes=0.0, keep_checkpoints=2,
      seed=0, router_bias_rate=1e-3,
      max_consecutive_skipped=10))
  # Lengths that follow the run (common.rl_follow_the_run), and the λ anneal over iterations.
  common.rl_follow_the_run(c)
  c.parl.anneal_steps = common.fit_to_run(c.parl.anneal_steps, c.train.get_ref("steps"), c.train.steps, at_least=1)
  return c
