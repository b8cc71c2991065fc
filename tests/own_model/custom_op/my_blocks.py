"""The model's sizes, in a sibling named like siblings/my_blocks.py (a different file)."""
WIDTH = 16
