"""inspection"""
