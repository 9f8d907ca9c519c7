"""This VM's hold: one maintenance state per VM driving the drain (enter), the undo (leave) and the approval gate."""
