"""Training: draft adapters and lookup corpora, from text the model writes itself.

A room of its own because it stands apart from any study: `train-adapter` and
`write-lookup-corpus` run on their own configs, and a study only reads the files they leave.
`train_adapter` trains an adapter from a `corpus`, a `teacher` pass and `training`;
`self_prompted`, `model_text` and `evaluation_texts` write the model's own text and keep the
evaluation prompts out of it; `write_lookup_corpus` saves that text as a lookup corpus. It reads
the model section and the strict TOML reading of `studies.toml_reader`, nothing else of the tuner.
"""
