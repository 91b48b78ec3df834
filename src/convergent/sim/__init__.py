"""Simulation: molecule sources, samplers, calculators and the Dask campaign.

* :mod:`~convergent.sim.sources` — resolves a source spec; xyz/extxyz (ase.io). Built on
  :mod:`~convergent.sim.molecules` (``Molecule``, G2/S22 from ASE, element / atom-count
  filters) and :mod:`~convergent.sim.smiles` (RDKit ETKDGv3 + MMFF, the NCI file in the
  RDKit wheel).
* :mod:`~convergent.sim.samplers` — seeded Gaussian rattle, seeded Langevin MD.
* :mod:`~convergent.sim.calculators` — GFN2-xTB (tblite), PySCF HF/DFT, EMT; provenance.
* :mod:`~convergent.sim.campaign` — :func:`run_campaign` -> :class:`CampaignSummary`: the
  fault-tolerant task farm (retries, timeouts, quarantine, streaming, resume), built from
  ``tasks`` (units of work), ``plan`` (keys, chunking), ``worker`` (running a task),
  ``records`` (encoding on the worker), ``guards`` (timeouts), ``farm`` (the driver loop),
  ``runner`` (cluster, writer, progress), ``resume``, ``quarantine`` and ``summary``.
* :mod:`~convergent.sim.relabel` — multi-fidelity relabelling into a second dataset.
* :mod:`~convergent.sim.config` — ``SimulateConfig``, ``RelabelConfig`` (``ClusterConfig`` is
  in :mod:`convergent.cluster.config`).
"""
