"""maspo-verl: granular importance-ratio policy losses for verl.

Importing the package registers ``maspo``, ``ctpo`` and ``pgspo`` in verl's policy-loss registry and
``maspo_span_grpo`` in its advantage-estimator registry, and installs the ``ppo_loss`` hook that
lets token ids reach the loss and the agent-loop hook that lets per-token reward scores reach
``rm_scores``. verl imports it on
``import verl`` through the ``verl.plugins`` entry point, in the driver and in every Ray worker.
verl swallows plugin import errors at debug level, so a failure here is also logged as an error.
"""

import logging
import os

__version__ = "0.1.0"

try:
    from maspo_verl import advantages as _advantages  # noqa: F401
    from maspo_verl import losses as _losses
    from maspo_verl.verl_glue import install_ppo_loss_hook as _install_ppo_loss_hook
    from maspo_verl.verl_glue import install_token_scores_hook as _install_token_scores_hook

    _install_ppo_loss_hook()
    _install_token_scores_hook()
    if os.environ.get("MASPO_VERL_LOCAL"):  # set for the driver and Ray workers by `local=cpu`
        from maspo_verl.local import activate as _activate_local

        _activate_local()
except Exception:  # pragma: no cover - exercised by the failing-plugin test in a subprocess
    logging.getLogger("maspo_verl").exception(
        "maspo_verl failed to load: its losses are NOT registered in verl (run `python -m maspo_verl check`)"
    )
    raise

REGISTERED_LOSSES = tuple(_losses.LOSSES)
