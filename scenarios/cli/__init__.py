"""The `edgeroute` command: parsing and handing off to the part that does the work."""
