"""The local tier: frequent snapshots of each rank's part in node-local memory, a partner's copy on another node.

``LocalTier`` is what a user asks for (``snapshot(..., local=LocalTier(...))``); ``LocalSaves`` saves local steps
(:mod:`.saves`); ``recover`` restores from the newest step every rank can restore (:mod:`.recovery`); ``nodes``
names each rank's node and partner; ``layout`` the names in a tier directory; ``transfer`` moves a part between
ranks. The extension drives them (``ppe_snapshot.extension.local_steps``).
"""
from ppe_snapshot.local_tier.config import LocalTier, check_triggers, local_tier
from ppe_snapshot.local_tier.layout import Held, held, inventory, remove_unfinished, steps
from ppe_snapshot.local_tier.nodes import NODE_ENV, partners, this_node, wards
from ppe_snapshot.local_tier.recovery import Fallback, Recovered, recover
from ppe_snapshot.local_tier.saves import START_TAG, LocalSaves, Ranks

__all__ = ["NODE_ENV", "START_TAG", "Fallback", "Held", "LocalSaves", "LocalTier", "Ranks", "Recovered", "check_triggers",
           "held", "inventory", "local_tier", "partners", "recover", "remove_unfinished", "steps", "this_node", "wards"]
