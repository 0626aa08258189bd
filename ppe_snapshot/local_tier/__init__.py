"""The local tier: frequent snapshots of each rank's part in node-local memory, a partner's copy on another node.

``LocalTier`` is what a user asks for (``snapshot(..., local=LocalTier(...))``); ``LocalSaves`` saves local steps
(:mod:`.saves`); ``recover`` restores from the newest step every rank can restore (:mod:`.recovery`); ``nodes``
names each rank's node and partner; ``layout`` the names in a tier directory; ``transfer`` moves a part between
ranks. The extension drives them (``ppe_snapshot.extension.local_steps``).
"""
from ppe_snapshot.local_tier.config import LocalTier, check_triggers, local_tier
from ppe_snapshot.local_tier.layout import inventory, steps
from ppe_snapshot.local_tier.nodes import partners, this_node, wards
from ppe_snapshot.local_tier.recovery import Fallback, Planning, Recovered, recover
from ppe_snapshot.local_tier.saves import START_TAG, LocalSaves, Ranks

__all__ = ["START_TAG", "Fallback", "LocalSaves", "LocalTier", "Planning", "Ranks", "Recovered", "check_triggers", "inventory",
           "local_tier", "partners", "recover", "steps", "this_node", "wards"]
