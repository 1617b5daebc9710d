"""`tetrictl top`: the Textual dashboard. It reaches the daemon only through `tetrictl.client`."""
