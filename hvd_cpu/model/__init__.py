"""What is trained: networks.py builds the MLP or the user's own Module (from its signature),
losses.py the loss by name or the user's own, optim.py the lean fused Adam, user_code.py
imports the user's code ("module:Name" or "file.py:Name"), code_source.py finds and checks
that code's source file without running it (what predict checks before importing it)."""
