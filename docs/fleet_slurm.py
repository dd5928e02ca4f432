"""A floorline sweep on GPUs that Slurm hands out, through dask-jobqueue.

Each Slurm job asks for one GPU and runs one Dask worker with a GPU resource of 1 (Slurm sets
the job's CUDA_VISIBLE_DEVICES). This script holds the scheduler, waits for the first worker,
then runs `floorline sweep --cluster` against it with the options after `--`, and cancels the
jobs when the sweep ends. Run it where jobs can be submitted, in an environment that the
compute nodes share (the same floorline, torch and transformers):

    pip install 'floorline[fleet]' dask-jobqueue
    python docs/fleet_slurm.py --jobs 4 --partition gpu -- --models qwen2.5-7b --db fleet.db

The job's resources below (cores, memory, the GPU request) are an example: edit them to your
site's. `--print-job` prints the job script without submitting anything.
"""

import argparse
import subprocess
import sys

from dask_jobqueue import SLURMCluster
from distributed import Client


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=2, help="Slurm jobs, one GPU each")
    parser.add_argument("--partition", help="Slurm partition (default: the site's)")
    parser.add_argument("--account", help="Slurm account to charge")
    parser.add_argument("--walltime", default="02:00:00", help="per job")
    parser.add_argument("--print-job", action="store_true", help="print the job script and stop")
    parser.add_argument("sweep", nargs=argparse.REMAINDER, help="-- then `floorline sweep` options")
    args = parser.parse_args()
    cluster = SLURMCluster(
        queue=args.partition, account=args.account, walltime=args.walltime,
        cores=8, memory="64GB", processes=1,  # one worker per job; memory is its limit
        job_extra_directives=["--gres=gpu:1"],
        worker_extra_args=["--resources", "GPU=1"],
        # The worker's statistical profiler samples its threads every 10 ms, beside the timing.
        job_script_prologue=["export DASK_DISTRIBUTED__WORKER__PROFILE__ENABLED=False"],
    )
    if args.print_job:
        print(cluster.job_script())
        return 0
    sweep = args.sweep[1:] if args.sweep[:1] == ["--"] else args.sweep
    with cluster, Client(cluster) as client:
        cluster.scale(jobs=args.jobs)
        print(f"waiting for the first of {args.jobs} Slurm jobs to start a worker", flush=True)
        client.wait_for_workers(1)
        return subprocess.call([sys.executable, "-m", "floorline", "sweep",
                                "--cluster", cluster.scheduler_address, *sweep])


if __name__ == "__main__":
    sys.exit(main())
