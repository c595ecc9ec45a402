from .plan import Plan, TopologyError, make_plan, ROLES
from .groups import Groups, build_groups, init_distributed, default_backend, nnodes_from_env
from .phases import Ledger, PhaseScheduler
from .exchange import all_gather_padded, shard_rows, broadcast_object
from .weight_sync import WeightSync, WeightSyncTimeout, bucket_plan
