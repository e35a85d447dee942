"""What rank 0 writes and prints: records.py (metrics.jsonl, ranks.json, features.json,
config.toml), console.py (lines and the progress bar), summary.py (the closing table and its
advice), tracking.py (TensorBoard, MLflow: a new tracker is one Tracker class there, listed
in asked_for), model_files.py (checkpoint.pt, model.pt), plot.py (loss.png); notebook.py is
the bar over the epochs that fit() shows in a notebook, read from rank 0's metrics.jsonl;
lock.py keeps a second job out of a folder a running job writes; seal.py seals the code a
model.pt names with this user's key, and model_code.py decides what predict may run of it.
Each file is written whole or not at all (hvd_cpu/atomic.py, shared with every room that
writes)."""
