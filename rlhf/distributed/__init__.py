from .placement import Placement, TopologyError, make_placement, ROLES
from .groups import Groups, build_groups, init_distributed, default_backend, nnodes_from_env
from .phases import Ledger, PhaseScheduler
from .sharding import all_gather_objects, gather_max, gather_rows, micro_count, micro_plan, run_micro, shard_rows
from .weight_sync import WeightSync, WeightSyncTimeout, bucket_plan
