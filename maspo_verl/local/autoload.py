"""The ``maspo_verl_local`` ``verl.plugins`` entry point: in a process of a local-mode run
(``MASPO_VERL_LOCAL`` set, for the driver and every Ray worker by ``maspo_verl.local.mode.prepare_run``),
``import verl`` activates the local mode's platform and rollout; elsewhere it does nothing."""

import logging
import os

if os.environ.get("MASPO_VERL_LOCAL"):
    try:
        from maspo_verl.local.adaptations import activate

        activate()
    except Exception:  # verl logs a failing plugin at debug level only
        logging.getLogger("maspo_verl.local").exception("maspo_verl local mode failed to activate in this process")
        raise
