"""Process plumbing shared by every edgeroute program: serving, TLS, settings, config files, CLI flags."""
