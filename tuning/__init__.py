"""The auto-tuner: Optuna studies that search skip sets and thresholds for one model on one
device, persisted in an ordinary Optuna storage, exported as a tuned profile and shared on the Hub.

Modules, one job each: `toml_reader` (reading any of its TOML files strictly), `config` (study
config files), `knobs` (the numeric knobs, and which of them a strategy searches), `space` (what
a trial tries), `objective` (measuring a trial), `storage` (where studies live and what they are
called), `tune` (running a study), `export`, `hub`, `dashboard`, `quickstart`, and `cli`
(argument wiring only). Draft adapters are trained by `train_adapter` from a `corpus`, a
`teacher` pass and `training`; `write_lookup_corpus` writes the model's own text as a lookup
corpus.
"""


class TuningError(Exception):
    """A problem the user can fix (a bad config, a missing study, no token): the command prints
    the message alone, without a traceback, and exits with status 2."""
