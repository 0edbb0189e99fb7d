"""FairSMoE's front ends of the runner: the method comparison, its table, the references that
learnt nothing, and the preflight's calibration rows."""
