"""The lab: pre-registered studies and benchmarks, ``python -m maspo_verl.lab <command>`` (``--help`` lists them).

- ``engine/``: what every study stands on, once: the arm grammar and presets (``presets``), the grid's cells
  (``cells``), the tabular policy (``tabular``) and the grid's engine on it (``grid``), tuning on tuning seeds
  (``tuning``), pairing, tests and Holm (``stats``), the journal of a results folder (``journal``: COMMAND.txt,
  versions, machine, load, its DEVIATIONS.md), tables and plots (``common``), the local trainer's runs (``runs``),
  the lab's in-process RL loop (``learn_engine``) and study discovery (``study``).
- ``studies/``: one module per study. A module that declares ``STUDY = Study(command, summary, folder=..., writes=...)``
  is a command of the CLI, a row of docs/lab.md's table and a folder tests/lab/test_regenerate.py regenerates.

Each command writes its tables and plots to ``outputs/lab/<folder>/`` (``--out DIR`` elsewhere, ``--update-docs``
the committed ``docs/results/<folder>/``) with a ``COMMAND.txt`` recording the exact command line that made them.
"""
