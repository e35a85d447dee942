"""Rows in, float32 matrices and batches out.

frames.py reads and writes frame files (a new format: its name and extensions in
config/formats.py, its reader and writer in frames.py); parquet.py reads parquet
files and folders row group by row group; columns.py holds what readers and encoder agree on
(unique text column names, batches of rows); features.py fits and applies the encoding of
columns to features; loader.py shares the rows out over the ranks and cuts the batches;
agreement.py has the ranks compare what they read before anything is fitted on it; demo.py
makes the demo frame.
"""
