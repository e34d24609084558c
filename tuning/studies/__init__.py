"""Studies: what a study is and where it lives, apart from how a trial is priced or a draft
trained.

A room of its own because everything here reads one typed study config (`config`, parsed once
by `toml_reader`) and the Optuna study it names: `knobs` (the numeric knobs, and which of them a
strategy searches), `space` (what a trial tries), `categories` (speedups per prompt category and
the floor), `objective` (measuring a trial), `study_prompts`, `storage` (where studies live and
what they are called), `study_toml` (writing a config), `export`, `dashboard` and `hub`. The
cost model builds on these; nothing here reads the cost model or the training room.
"""
