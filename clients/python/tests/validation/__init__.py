"""The blind validation set of issue 39: see README.md."""
