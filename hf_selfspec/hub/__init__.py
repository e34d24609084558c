"""Sharing tuned profiles through transformers' own `custom_generate`, so that a model's users get
the speed-up with nothing installed but transformers: `package` writes the folder, `cli` wires
`hf-selfspec package`, and `generate_entry` becomes the folder's `custom_generate/generate.py`."""
