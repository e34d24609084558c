"""The auto-tuner: Optuna studies that search skip sets and thresholds for one model on one
device, persisted in an ordinary Optuna storage, exported as a tuned profile and shared on the Hub.

Three rooms, each a sub-package that says why it stands apart: `studies` (the study config, the
search space, measuring a trial, storage, export, the dashboard and the Hub), `costmodel` (the
estimated objective and everything it times and prices) and `training` (draft adapters, corpora
and the model's own text). Above them: `tune` (running a study, measured or estimated),
`default_study` (a study derived from the model's shape), `optimize` and `quickstart` (the
commands that chain the rest), and `cli` (argument wiring only). The core is reached through the
names `hf_selfspec.tuner_api` declares.
"""


class TuningError(Exception):
    """A problem the user can fix (a bad config, a missing study, no token): the command prints
    the message alone, without a traceback, and exits with status 2."""
