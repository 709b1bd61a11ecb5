"""Upper bounds on the sizes mmplan reads from a file or an option, checked before any work proportional to them."""

MAX_GLOBAL_BATCH = 2**24  # samples per optimizer step (16.7 M; the largest published steps are ~10^5 samples)
MAX_MICRO_BATCHES = 4096  # micro-batches per step: the schedule simulation and the runtime loop over each one
MAX_FILE_BYTES = 256 * 2**20  # profile, plan, cluster TOML, metrics log: larger inputs are refused unread
MAX_BLOCKS = 10_000  # blocks of a profile or a plan's flow (a 72B model has ~200; the solver is tested at this size)
