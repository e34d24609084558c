"""A fast stand-in for measuring a trial: teacher-forced acceptance and a calibrated cost model.

Under greedy decoding the verifier's tokens are known once plain decoding has run, so whether a
draft token is accepted depends only on whether the draft predicts that known continuation.
One forward pass of the draft over the continuation yields every prediction at once. The decoding
loop itself (`speculative_decode`) then runs over them with the strategy's own parts, the known
tokens standing in for the full model's forward pass and the predictions for the model's draft,
while a clock priced by a cost model timed on this machine stands in for wall time: the
counters are the ones a real decode reports, and a drafter, policy or adaptive rule added to the
loop is estimated with no second description of it. A trial then costs one draft pass per
prompt instead of two timed decodes, and its value carries no timing noise, which the sampler
needs more than it needs the last few percent of accuracy.

The pass masks attention so that the draft at each position reads the full model's KV for the
text before it, as a real draft does for committed text; its first proposal after every prefix
is therefore exact. A trained adapter's draft (Kangaroo) is exact further: its shallow layers
are the full model's own, so while its earlier tokens are right its later ones read exactly the
text the pass gives them, and past a wrong token its real continuation is drafted too, on side
branches. The draft's alternatives (`draft_alternatives`) are its runner-ups at each position,
kept from the same pass. What is approximated: a layer-skip draft's second and later tokens
read the KV of its own earlier draft tokens, here the full model's, and past a wrong token it
is taken to go on with the next positions' teacher-forced guesses; logits processors are not
applied; and the cost model is only as steady as the machine: it is timed in interleaved rounds
so that a burst of load bends no price against another, and re-checked during the study
(`CostModelWatch`), but a load that comes and goes between checks still moves it. So the
estimate ranks trials; the top ones are then confirmed by real decoding (`confirm_top`), and
only measured speedups are reported as such.

A room of its own, by job: `timing` (interleaved rounds on a shared machine), `prices` (the cost
model), `teacher_forcing` (the known text every trial reads), `calibration` (timing the prices),
`predictions` (the draft's guesses from one pass), `priced_decode` (the loop run over them),
`estimated` (the objective) and `drift` (re-timing during a study). It reads the study's config
and prompts (`studies`); only running a study (`tune`) reads it, so nothing here waits on the
rest of the tuner.
"""

from .estimated import estimated_objective
from .prices import record_cost_model
from .teacher_forcing import check_supported, teacher_force

__all__ = ["check_supported", "estimated_objective", "record_cost_model", "teacher_force"]
