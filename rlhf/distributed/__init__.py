from rlhf.distributed.groups import Groups, RankGroup, build_groups, nnodes_from_env, supervised_mesh
from rlhf.distributed.mesh import RoleMesh
from rlhf.distributed.phases import Ledger, PhaseScheduler
from rlhf.distributed.placement import ROLES, Placement, TopologyError, make_placement, role_needs
from rlhf.distributed.sharding import all_gather_objects, gather_max, gather_rows, micro_count, micro_plan, run_micro, shard_rows
from rlhf.distributed.weight_sync import WeightSync, WeightSyncTimeout, bucket_plan
