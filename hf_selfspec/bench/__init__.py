"""`hf-selfspec bench`: speed and losslessness of every strategy against plain `generate`.

contenders -> what runs; sampling -> the settings and seeds every contender samples with under
--do-sample; runner -> interleaved timing; report -> the `results.json` figures; table and
plots -> their renderings; cli -> the command line.
"""
