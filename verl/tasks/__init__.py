"""The project's built-in tasks and the models they are built with, made by its own code (no hub).

- `embedded`: the embedded tasks (`arithmetic`, `runsum`, `toolchain`): prompts, answers and a
  tiny draft / guidance pair per task, supervised-trained once and cached; it registers the
  `embedded://<task>@<split>` dataset scheme (`verl.utils.dataset.register_row_source`).
- `embedded_tools`: the multi-turn `toolchain` task's data, episodes and measures;
  `toolchain_report` prints its turn-loop figures.
- `tiny_lm`: the character tokenizer and tiny Qwen2 / Llama models the tasks and tests build.
- `real_model`: the real pretrained pair rebuilt from the SmolLM2 checkpoint a package ships.
- `synthetic`: random RL batches for the actor's tests and benchmarks.

Dependencies point one way: these modules import the workers and `verl.utils`; nothing under
`verl/utils/` or `verl/workers/` imports them (the trainer does, for the embedded default).
"""
