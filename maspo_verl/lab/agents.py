"""``python -m maspo_verl.lab.agents``, the name committed results' COMMAND.txt runs: the study is
:mod:`maspo_verl.lab.studies.agents`."""

from maspo_verl.lab.studies.agents import main

if __name__ == "__main__":
    raise SystemExit(main())
