"""Planning: parameter sweeps over the simulator and the ESG search of workflow configurations."""
