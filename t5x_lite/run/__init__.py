"""Runs: the training loop, checkpoint evaluation, batch inference and TPU precompilation.

Each is what an entry point calls (`train_lib.train`, `eval_lib.evaluate_checkpoints`,
`infer_lib.infer`, `precompile`), over a jitted predict / score runner (`model_runner`).
Training first checks what it will need (`train_checks`) and locks its MODEL_DIR
(`model_dir_lock`).
"""
