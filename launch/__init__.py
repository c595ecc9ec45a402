"""Launchers: sbatch scripts (slurm/), submitit (launch.submit), Ray (launch.ray_submit)."""
