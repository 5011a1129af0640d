"""Every environment variable of air_magic's own, by name: the one place they are spelled.

Two kinds. **Settings** a user (or a test) exports to change air_magic's behaviour;
**rank variables** the launcher gives each rank beside torchrun's (``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR``... see ``launch/rank_env.py``), which the rank side reads.
"""

from __future__ import annotations

# -- settings -----------------------------------------------------------------------------
LOG_ROOT = "AIR_MAGIC_LOG_DIR"  # where each call's log folder is made (default: paths.default_log_root)
MLFLOW_DIR = "AIR_MAGIC_MLFLOW_DIR"  # the embedded MLflow store's folder
METRICS_MODE = "AIR_MAGIC_METRICS"  # 'batched' (default) or 'direct' (MLflow's own path)
WARM = "AIR_MAGIC_WARM"  # '0' turns the warm starter off
PRELOAD = "AIR_MAGIC_PRELOAD"  # modules the warm starter imports (comma-separated; default torch)
STARTER_WAIT = "AIR_MAGIC_STARTER_WAIT"  # seconds a starter may take to become ready
FORCE_CPU = "AIR_MAGIC_FORCE_CPU"  # '1': plan CPU ranks even when GPUs are visible
CPU_RANKS = "AIR_MAGIC_CPU_RANKS"  # how many CPU ranks a machine without GPUs runs by default
STACKS = "AIR_MAGIC_STACKS"  # how stacks are taken: 'auto' (py-spy if installed), 'py-spy' or 'signal'
RAY_PLACE_WAIT = "AIR_MAGIC_RAY_PLACE_WAIT"  # seconds a Ray placement may take before the call fails
RAY_INIT_TIMEOUT = "AIR_MAGIC_RAY_INIT_TIMEOUT"  # seconds ray_init may take to connect (default 60)
RAY_JOB_PYTHON = "AIR_MAGIC_RAY_JOB_PYTHON"  # the cluster's Python for a detached run's job (python3)
SUBMITTED_WITH = "AIR_MAGIC_SUBMITTED_WITH"  # in a Ray job: the submitter's air_magic version
MLFLOW_UI_AUTO = "AIR_MAGIC_MLFLOW_UI"  # 0: never start the UI server on its own; 1: even outside a kernel
MLFLOW_UI_URL = "AIR_MAGIC_MLFLOW_UI_URL"  # the browser's address of the UI server, "{port}" filled in
# torchrun's: seconds its agent waits after forwarding a stop signal before SIGKILL (stop_grace's default)
TORCH_SHUTDOWN_TIMEOUT = "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"

# -- Ray's own, which air_magic sets when it starts a local Ray (backends/ray/cluster.py) ----------
RAY_ADDRESS = "RAY_ADDRESS"
RAY_AUTH_MODE = "RAY_AUTH_MODE"
RAY_AUTH_TOKEN_PATH = "RAY_AUTH_TOKEN_PATH"
RAY_USAGE_STATS = "RAY_USAGE_STATS_ENABLED"
# Measured on Ray 2.60 (NOTES.md): with this set to 0 before start, every listener binds
# 127.0.0.1; _node_ip_address alone is silently replaced by the machine's address.
RAY_LOCAL_ONLY = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"

# -- MLflow's and JupyterHub's own, which the MLflow UI server uses (tracking/ui.py, ui_server.py) ------
MLFLOW_BACKEND_STORE_URI = "MLFLOW_BACKEND_STORE_URI"  # the UI server's store (never on a command line)
MLFLOW_SERVER_JOB_EXECUTION = "MLFLOW_SERVER_ENABLE_JOB_EXECUTION"  # MLflow's job runner, off for the UI
JUPYTERHUB_SERVICE_PREFIX = "JUPYTERHUB_SERVICE_PREFIX"  # /user/NAME/: the proxy's path to the UI
JUPYTERHUB_PUBLIC_URL = "JUPYTERHUB_PUBLIC_URL"  # https://HUB/user/NAME/ where the hub knows it
JUPYTERHUB_HOST = "JUPYTERHUB_HOST"  # https://NAME.HUB on a hub with one subdomain per user
# What the shared UI server gets of its starter's environment (ui_server.minimal_environment): what
# runs Python and MLflow, never the rest (a kernel's secrets; the server lives up to a day).
UI_SERVER_KEPT = frozenset(
    {
        "PATH", "HOME", "USER", "LOGNAME", "LANG", "LANGUAGE", "TZ", "TMPDIR", "LD_LIBRARY_PATH",
        "VIRTUAL_ENV",
    }
)  # fmt: skip
UI_SERVER_KEPT_PREFIXES = ("LC_", "PYTHON", "MLFLOW_")
# ...but of MLflow's, none that names a credential or another server (a tracking URI may hold a password)
UI_SERVER_DROPPED_WORDS = ("TOKEN", "PASSWORD", "SECRET", "KEY", "CREDENTIAL", "USERNAME", "AUTH", "TRACKING")

# -- rank variables -----------------------------------------------------------------------
# The call's id; set means "this process is a rank". The variable keeps its name: ranks' code reads it.
CALL_ID = "AIR_MAGIC_RUN_ID"
RUN_ID = CALL_ID  # the former name of CALL_ID
RUN_DIR = "AIR_MAGIC_RUN_DIR"  # the call's private folder (payload, results, error records)
LOG_DIR = LOG_ROOT  # in a rank: the call's own log folder (the same name: a rank makes no calls)
LIFELINE_FD = "AIR_MAGIC_LIFELINE_FD"  # read end of the pipe whose EOF means "the caller is gone"
# The read ends of the rank's own stdout and stderr pipes ("out,err"): if the caller dies, what is
# still in them goes into the rank's log before the rank goes (worker/entry.py, _watch_lifeline).
OUTPUT_FDS = "AIR_MAGIC_OUTPUT_FDS"
CALLER_PID = "AIR_MAGIC_CALLER_PID"  # the process that made the call (a warm rank's parent is the starter)
BACKEND = "AIR_MAGIC_BACKEND"  # 'nccl' or 'gloo': what init_process_group() picks
DEVICE = "AIR_MAGIC_DEVICE"  # 'cuda' or 'cpu'
METRICS_DIR = "AIR_MAGIC_METRICS_DIR"  # where ranks append their MLflow metrics (worker/metrics.py)
SHARED_RUN = "AIR_MAGIC_MLFLOW_RUN_ID"  # the call's MLflow run, which ranks keep open (worker/mlflow_hook.py)


# -- what the launcher gives each rank (launch/rank_env.py) -------------------------------------
# A persistent session's ranks keep these as launched when the notebook changes its own (each
# cell follows the notebook's other changes: calls/persistent.py, worker/session_rank.py).
LAUNCH_NAMES = frozenset(
    {
        "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK", "GROUP_RANK", "ROLE_RANK",
        "ROLE_WORLD_SIZE", "ROLE_NAME", "GROUP_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
        "CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "OMP_NUM_THREADS", "PYTHONUNBUFFERED",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING", "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "ACCELERATE_USE_CPU",
    }
)  # fmt: skip
LAUNCH_PREFIXES = ("TORCHELASTIC_", "AIR_MAGIC_", "MLFLOW_")
# Of those, what says where a rank stands and how it finds its peers and its caller: ``env=`` may not
# set them (a rank told another RANK or WORLD_SIZE ends "without a result", far from the cause).
SET_BY_THE_LAUNCHER = frozenset(
    {
        "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK", "GROUP_RANK", "ROLE_RANK",
        "ROLE_WORLD_SIZE", "GROUP_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID",
        "TORCHELASTIC_ERROR_FILE", "TORCHELASTIC_USE_AGENT_STORE", CALL_ID, RUN_DIR, LOG_DIR, LIFELINE_FD,
        OUTPUT_FDS, CALLER_PID, METRICS_DIR, SHARED_RUN,
    }
)  # fmt: skip


def kept_by_the_ranks(name: str) -> bool:
    """A variable a session's ranks keep as launched, whatever the notebook does with its own."""
    return name in LAUNCH_NAMES or name.startswith(LAUNCH_PREFIXES)
