"""The commands beside training: predict.py (predictions from model.pt), bench.py (which
setting trains fastest here), doctor.py (what this machine and its hosts can run),
hostfile.py (host files, one reader for every launcher script)."""
