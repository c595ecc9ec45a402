from .groups import Groups, RankGroup, build_groups, nnodes_from_env, supervised_mesh
from .mesh import RoleMesh
from .phases import Ledger, PhaseScheduler
from .placement import ROLES, Placement, TopologyError, make_placement, role_needs
from .sharding import all_gather_objects, gather_max, gather_rows, micro_count, micro_plan, run_micro, shard_rows
from .weight_sync import WeightSync, WeightSyncTimeout, bucket_plan
