"""What rank 0 writes and prints: records.py (metrics.jsonl, ranks.json, features.json,
config.toml), console.py (lines and the progress bar), summary.py (the closing table and its
advice), tracking.py (TensorBoard, MLflow: a new tracker is one Tracker class there, listed
in asked_for), model_files.py (checkpoint.pt, model.pt), atomic.py (files written whole or not
at all), plot.py (loss.png)."""
