"""node/kvshare"""
