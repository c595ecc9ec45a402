from .groups import Groups, build_groups, nnodes_from_env
from .phases import Ledger, PhaseScheduler
from .placement import ROLES, Placement, TopologyError, make_placement
from .sharding import all_gather_objects, gather_max, gather_rows, micro_count, micro_plan, run_micro, shard_rows
from .weight_sync import WeightSync, WeightSyncTimeout, bucket_plan
