"""Collectives outside the token exchange: the ranks' agreement on the setup and the experts' gathers and sums."""
