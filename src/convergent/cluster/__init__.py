"""Where work runs: the Dask pool, Slurm, CPU/GPU placement and this process's resources.

``pool`` (the Dask cluster factory: local | slurm | address, with a GPU job kind),
``config`` (the ``cluster`` config section), ``slurm`` (job size, refusal, lost jobs, job
counts), ``pinning`` (one core per Dask worker of a Slurm job), ``placement`` (device,
ranks and collective backend from the visible GPUs), ``resources`` (usable CPUs, threads).
"""
