"""Agents for PARL: the token DSL (`dsl`), the tool protocol and its parser (`tools`), and the
budgeted wide-search environment with scripted reference policies (`widesearch`)."""
