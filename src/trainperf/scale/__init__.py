"""Beyond one machine: rendezvous, Slurm scripts, the fabric benchmark and the scaling model."""
