"""`hf-selfspec bench`: speed and losslessness of every strategy against plain `generate`.

contenders -> what runs; runner -> interleaved timing; report -> the `results.json` figures;
table and plots -> their two renderings; cli -> the command line.
"""
